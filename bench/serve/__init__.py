"""A running `tandem serve` against the engine alone: `tandem bench serve`, its clients and its server."""
