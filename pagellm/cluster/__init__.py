"""Replicas on Ray: the cluster file, the controller actor, the replica actor, autoscaling."""
