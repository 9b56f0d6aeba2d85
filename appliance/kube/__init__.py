"""Kubernetes edges of the appliance: the pod watch (a source), Events on pods and the node's
GPU status (sinks), the device plugin, and the cluster's admission webhook and scheduler
extender (programs of their own). Which pod a process belongs to is the host's word
(`appliance.host`), not the API server's.
"""
