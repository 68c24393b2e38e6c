"""The state store shared by `fleet apply` and `fleet serve`: written once over a dialect
seam (`sql`), embedded SQLite (`store`) or shared PostgreSQL (`pg`), picked by URL (`backend`)."""
