"""Every option through every door: the option matrix (issue 33)."""
