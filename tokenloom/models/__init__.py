"""Model implementations; see ``registry`` for architecture lookup."""
