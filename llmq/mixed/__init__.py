"""Mixed precision to a budget: each linear's scheme chosen from candidates by measured damage."""
