"""What this host offers (cores, huge pages, free page reporting) and how files on it are kept
from other local users."""
