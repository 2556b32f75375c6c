"""What goes on the wire: transport codecs, and (coming) compression, error feedback, DP reducers, a wire meter."""
