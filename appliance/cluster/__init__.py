"""The cluster's programs, apart from the node daemon: the MIG fallback admission webhook and
the scheduler extender, their caches of the cluster and their HTTP serving."""
