"""duplexpipe's benchmarks: parts (`benchmarks.framework.Part`) run by one runner (`python -m benchmarks`)."""
