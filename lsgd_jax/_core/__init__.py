"""The private core every concern uses: argument checks, the state idiom, groups of
replicas and their means, and what JAX has no public API for yet."""
