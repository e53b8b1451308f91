"""Documents (knowledge): the agent's documents, cut into embedded fragments, and who may read them."""
