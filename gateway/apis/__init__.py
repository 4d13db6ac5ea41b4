"""The APIs: one package per API family, each turning its requests into the core's
generations and spelling the core's events its own way. An API never imports another."""
