"""What a run reports: its metrics and the progress bar."""
