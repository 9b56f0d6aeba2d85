"""Where pods should go: what nodes publish about their GPUs, and how a scheduler judges it.

Pure code (no sockets, files, threads or clocks): `status` is the document a node daemon
writes on its Node and reads back, `demand` is what a pod needs (`resources`: its extended
resources as the API serves them), `fit` is the real-time check the scheduler extender
applies. The I/O around them lives in `appliance.kube.node_status` (the publisher) and
`appliance.cluster.extender` (the HTTP extender and its caches).
"""
