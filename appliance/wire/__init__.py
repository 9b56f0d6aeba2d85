"""The wire: the frames between the hook (or nvsharectl) and the node daemon, mirroring
`ld_hook/nvshare_proto.h`, and where the sockets live. Knows the core's events and actions,
nothing of sockets' I/O."""
