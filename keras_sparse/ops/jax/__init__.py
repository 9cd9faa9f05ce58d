"""JAX ops: the lookup primitive (`lookup`) and its compiled row update."""
