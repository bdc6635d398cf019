"""Ray Serve application: ingress (HTTP + gRPC), target worker, draft worker, transport."""
