"""One module per parallel strategy; the train step composes them."""
