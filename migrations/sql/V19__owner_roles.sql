-- Each side's schema and tables are owned by a role nobody logs in as (issue 24). The
-- service's login role gets only what it uses: USAGE on its schema and SELECT, INSERT,
-- UPDATE, DELETE on its tables. So a compromised service can neither alter its tables nor
-- plant a trigger on them, which would run as whoever writes next, a migration's superuser
-- included, nor create objects in its schema. Grants made by the previous owner (the
-- relay's SELECT on the outbox) move to the new owner with the tables.
DO $$
DECLARE
  owner text;
BEGIN
  FOREACH owner IN ARRAY ARRAY['consumers_owner', 'workers_owner'] LOOP
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = owner) THEN
      BEGIN
        EXECUTE format('CREATE ROLE %I NOLOGIN', owner);
      EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
      END;
    END IF;
  END LOOP;
END
$$;

SET LOCAL lock_timeout = '2s';

ALTER SCHEMA consumers OWNER TO consumers_owner;
ALTER TABLE consumers.messages     OWNER TO consumers_owner;
ALTER TABLE consumers.outbox       OWNER TO consumers_owner;
ALTER TABLE consumers.inbox        OWNER TO consumers_owner;
ALTER TABLE consumers.inbox_writer OWNER TO consumers_owner;
ALTER TABLE consumers.chats        OWNER TO consumers_owner;
ALTER TABLE consumers.chat_members OWNER TO consumers_owner;
ALTER FUNCTION consumers.assign_feed_position() OWNER TO consumers_owner;
GRANT USAGE ON SCHEMA consumers TO consumers;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA consumers TO consumers;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA consumers TO consumers;
ALTER DEFAULT PRIVILEGES FOR ROLE consumers_owner IN SCHEMA consumers
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO consumers;
ALTER DEFAULT PRIVILEGES FOR ROLE consumers_owner IN SCHEMA consumers
  GRANT USAGE, SELECT ON SEQUENCES TO consumers;

ALTER SCHEMA workers OWNER TO workers_owner;
ALTER TABLE workers.messages     OWNER TO workers_owner;
ALTER TABLE workers.outbox       OWNER TO workers_owner;
ALTER TABLE workers.inbox        OWNER TO workers_owner;
ALTER TABLE workers.inbox_writer OWNER TO workers_owner;
ALTER TABLE workers.chats        OWNER TO workers_owner;
ALTER TABLE workers.chat_members OWNER TO workers_owner;
ALTER FUNCTION workers.assign_feed_position() OWNER TO workers_owner;
GRANT USAGE ON SCHEMA workers TO workers;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA workers TO workers;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA workers TO workers;
ALTER DEFAULT PRIVILEGES FOR ROLE workers_owner IN SCHEMA workers
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO workers;
ALTER DEFAULT PRIVILEGES FOR ROLE workers_owner IN SCHEMA workers
  GRANT USAGE, SELECT ON SEQUENCES TO workers;
