"""Remote calls: the agent, its links, incoming dispatch and the module-level API."""
