"""Speculative decoding: settings and proposers (plain Python; verification lives in
``pagellm/sampling/rejection.py``)."""
