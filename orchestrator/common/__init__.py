"""What the training loop and the driver's side (tracking, runner) both read, below both: the typed report a rank
hands over and its wire form (`report`), values as models take and give them (`values`), and a model's train and
eval modes (`modes`). Nothing here imports the training package, Ray or MLflow."""
