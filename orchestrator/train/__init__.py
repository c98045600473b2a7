"""What runs on each worker without Ray: the training loop, its step, the train state, data, models."""
