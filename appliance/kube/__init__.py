"""Kubernetes edges of the appliance: the pod watch (a source), Events (a sink), the kernel's
view of which pod a process belongs to, the device plugin and the admission webhook.
"""
