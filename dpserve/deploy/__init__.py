"""Deployment files: `dpserve compose` writes the Docker Compose stack (compose.yaml, compose.cpu.yaml);
`dpserve kube` the Kubernetes manifests."""
