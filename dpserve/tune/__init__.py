"""`dpserve tune`: kv_aware's weights chosen for a recorded workload, by replaying it in a model."""
