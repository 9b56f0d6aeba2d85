"""Kubernetes edges of the appliance: the pod watch (a source), Events on pods and the node's
GPU status (sinks), the device plugin, and the API client and caches the cluster's programs
(`appliance.cluster`) build on. Which pod a process belongs to is the host's word
(`appliance.host`), not the API server's.
"""
