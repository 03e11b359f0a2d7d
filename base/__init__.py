"""The ground floor: the user-error boundary, the validators every config object uses, the
Hydra entry decorator, atomic file writes and the progress display. Imports nothing of ours, so
every package above can use it."""
