"""Database seam: named SQL queries and connection helpers over psycopg 3."""
