"""The server under long, messy load: `tandem bench soak`."""
