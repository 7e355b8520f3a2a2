"""The operator's web console: a live view of one engine (KV block map, queues, rates) or of a
gateway's fleet, and a chat playground. Static files in ``static/`` (no build step, nothing
fetched at run time); ``snapshot`` reads engine state (plain Python), ``routes`` serves both."""
