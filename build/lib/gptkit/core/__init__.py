"""Foundations every layer uses: one error type for user mistakes, typed settings, devices and precision, processes, atomic files, downloads, progress bars, signals."""
