"""The training loop's pieces: learning-rate schedule, optimizers (Muon), weight averaging, run directory, run log and curves."""
