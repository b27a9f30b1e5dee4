-- Roles: one per service (owns only its own schema) and one relay role per side (LOGIN
-- REPLICATION, no table grants: it reads the outbox through its replication slot only).
-- Roles are cluster-wide while migrations run per database, so each is created only when
-- missing, and a concurrent migration of another database creating it first is not an error.
DO $$
DECLARE
  spec text[];
BEGIN
  FOREACH spec SLICE 1 IN ARRAY ARRAY[
    ARRAY['consumers',       'LOGIN'],
    ARRAY['workers',         'LOGIN'],
    ARRAY['consumers_relay', 'LOGIN REPLICATION'],
    ARRAY['workers_relay',   'LOGIN REPLICATION']
  ] LOOP
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = spec[1]) THEN
      BEGIN
        EXECUTE format('CREATE ROLE %I %s', spec[1], spec[2]);
      EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
      END;
    END IF;
  END LOOP;
END
$$;

-- Each service owns its schema and nothing else; no one else gets USAGE on it.
CREATE SCHEMA consumers AUTHORIZATION consumers;
CREATE SCHEMA workers AUTHORIZATION workers;
REVOKE ALL ON SCHEMA consumers FROM PUBLIC;
REVOKE ALL ON SCHEMA workers FROM PUBLIC;
