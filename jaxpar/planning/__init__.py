"""The planner: layouts enumerated and ranked by a memory and step-time model before anything
compiles (`python -m jaxpar.plan`), the published runs it is fitted to, and the CPU host check."""
