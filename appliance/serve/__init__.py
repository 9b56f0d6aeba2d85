"""The node daemon's Unix sockets: accepting peers, bounding their I/O, turning their frames
into core events and core actions into frames."""
