"""Elastic replicas: how many replicas each model's load needs (the desired-replicas signal), and the
requests that wait for a replica to start when none serves."""
