"""The planner (torch-free): profile data, byte memory model, DP comm model, machine model and the plan."""
