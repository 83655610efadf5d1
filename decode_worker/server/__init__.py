"""The HTTP surface: a router per API family, request schemas, errors and the guard."""
