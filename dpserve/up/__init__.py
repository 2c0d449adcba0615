"""`dpserve up`: the supervisor that plans, starts and restarts replicas and the router as local processes."""
