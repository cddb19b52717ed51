"""What train, bench, profile and plan share to measure and predict a model's step, below all of them."""
