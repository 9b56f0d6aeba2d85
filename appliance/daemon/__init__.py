"""The node daemon's wiring: the engine (the event loop around the core), the queries read on
it, the sinks of its own (limits file, limit log, systemd notification) and `daemon`, the
composition root that builds and connects them."""
