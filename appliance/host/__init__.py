"""The host's word on a process: its credentials from the socket (SO_PEERCRED) and what /proc
says of it, including the pod, container or systemd unit its cgroup names. Not Kubernetes
code: bare metal reads the same files."""
