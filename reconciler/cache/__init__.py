"""What one run keeps for the next: the observed states (`observed`) and a validated fleet
file (`desired`), each a private file tagged with the code that made it."""
