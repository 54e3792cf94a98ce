"""How one model trains: trainers, one trial's training state, the user's own loop, image data."""
