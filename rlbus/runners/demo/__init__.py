"""`rlbus demo`: a real RL loop on the fleet, written against the public SDK only."""
