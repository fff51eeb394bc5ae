"""The project from outside: the README's commands, the wheel, the Docker image and compose file."""
