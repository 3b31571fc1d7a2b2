"""pagemill under other serving frameworks: a Ray Serve application (`ray_app`) whose
replicas each run `pagemill launch` (`local_server`) and relay HTTP to it (`relay`)."""
