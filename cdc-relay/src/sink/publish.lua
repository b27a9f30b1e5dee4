-- (After trim.lua, which the relay puts in front of this script: id_less, trim_acked.)
--
-- Publish one batch of outbox entries into a stream, atomically (a script runs alone and,
-- with appendfsync always, its writes are fsynced before the reply).
--
-- KEYS[1]  the stream
-- KEYS[2]  the stream's record (hash): which Postgres system and timeline write it
-- ARGV[1]  system_id of the Postgres cluster the entries come from
-- ARGV[2]  its timeline
-- ARGV[3]  the last-resort cap on the stream's length ('0': none); see trim() below
-- ARGV[4]  fence: the last id this relay session published before this batch ('' at the
--          start of a session); the stream's top must have reached it
-- ARGV[5]  the LSN (decimal) the relay will acknowledge to its slot once this call returns
--          ('': none). Recorded as `acked_through`, so Redis always knows at least as much
--          as the slot says was delivered: a Redis that lost data shows an older value.
-- ARGV[6]  the shard count the relay writes with: the record must state the same (a stream
--          resized while this relay ran is refused with SHARDS; records from before shards
--          existed state nothing, which means 1)
-- ARGV[7]  the writer epoch of the relay session (see `writer_epoch` below); a session
--          older than the one the record names is refused with FENCED
-- ARGV[8..] six per entry: id, event, payload, outbox_id, created_at, traceparent ('': none);
--          ids strictly increase. Each new entry also gets `published_at`: this call's TIME
--          in Unix microseconds, the start of the consumers' published-to-recorded latency
--
-- Returns {published, duplicates, unread_trimmed}. An entry whose id is not above the
-- stream's last-generated-id is a replay (Postgres re-sends what the slot did not
-- acknowledge): it is counted, not written, after checking that the entry stored under that
-- id, if still there, is the same outbox row.
-- Errors (codes read by the relay): FENCED (a newer relay session writes the stream), SHARDS (the stream was resized), NORECORD (the record is gone: Redis lost data, or an
-- operator deleted it to force a rebuild; only `setup` and a rebuild write a record),
-- ORIGIN (another cluster's stream), TIMELINE (the record names another timeline: the
-- relay checks the history before going on), GAP (the stream lost entries this session
-- published), DIVERGED (same id, different row, or an id below the top that the stream
-- never held).

local stream, origin_key = KEYS[1], KEYS[2]
local system_id, timeline, maxlen, fence, ack, shards = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local epoch = tonumber(ARGV[7])
local FIRST, PER = 8, 6

local origin = redis.call('HMGET', origin_key, 'system_id', 'timeline', 'acked_through', 'shards', 'writer_epoch')
if not origin[1] then
  return redis.error_reply('NORECORD ' .. origin_key .. ' is missing')
elseif origin[1] ~= system_id then
  return redis.error_reply('ORIGIN ' .. origin[1])
elseif origin[2] ~= timeline then
  return redis.error_reply('TIMELINE the record says ' .. tostring(origin[2]) .. ', the relay reads timeline ' .. timeline)
elseif (origin[4] or '1') ~= shards then
  return redis.error_reply('SHARDS ' .. (origin[4] or '1'))
elseif epoch < tonumber(origin[5] or '0') then
  -- A relay took the stream over (or rebuilt it) since this session began: this session
  -- (paused, partitioned, retrying an old batch) must not write behind it.
  return redis.error_reply('FENCED the stream is written by epoch ' .. origin[5] .. ', this session is ' .. ARGV[7])
end

local top, first = '0-0', nil
if redis.call('EXISTS', stream) == 1 then
  local info = redis.call('XINFO', 'STREAM', stream)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      top = info[i + 1]
    elseif info[i] == 'first-entry' and info[i + 1] then
      first = info[i + 1][1]
    end
  end
end

if fence ~= '' and id_less(top, fence) then
  return redis.error_reply('GAP top ' .. top .. ' is below ' .. fence)
end

-- The record beside the stream: the acknowledged LSN (only ever raised) and the last id
-- the relay wrote, so a stream that lost entries (deleted, restored from an older state)
-- is noticed at the next start.
local function record(last_i)
  if ack ~= '' and (not origin[3] or num_less(origin[3], ack)) then
    redis.call('HSET', origin_key, 'acked_through', ack)
  end
  if last_i then
    redis.call('HSET', origin_key, 'last_id', ARGV[last_i])
  end
end

-- Redis's clock, read once per call: every entry of the batch was stored at that moment.
local clock = redis.call('TIME')
local published_at = clock[1] .. string.sub('000000' .. clock[2], -6)

local function add(i)
  if ARGV[i + 5] == '' then
    redis.call('XADD', stream, ARGV[i],
      'event', ARGV[i + 1], 'payload', ARGV[i + 2], 'outbox_id', ARGV[i + 3], 'created_at', ARGV[i + 4], 'published_at', published_at)
  else
    redis.call('XADD', stream, ARGV[i],
      'event', ARGV[i + 1], 'payload', ARGV[i + 2], 'outbox_id', ARGV[i + 3], 'created_at', ARGV[i + 4], 'published_at', published_at,
      'traceparent', ARGV[i + 5])
  end
end

-- At the cap, whatever still has to go after trim_acked (see trim.lua) is unread:
-- counted, so the relay can say so and alert. With no group at all nothing counts as read.
local function trim()
  trim_acked(stream)
  if maxlen > 0 and redis.call('XLEN', stream) > maxlen then
    return redis.call('XTRIM', stream, 'MAXLEN', maxlen)
  end
  return 0
end

-- Fast path: the batch starts above the top, and ids increase, so every entry is new.
if #ARGV < FIRST or id_less(top, ARGV[FIRST]) then
  for i = FIRST, #ARGV, PER do
    add(i)
  end
  local unread = 0
  if #ARGV >= FIRST then unread = trim() end
  record(#ARGV >= FIRST and (#ARGV - PER + 1) or nil)
  return {(#ARGV - FIRST + 1) / PER, 0, unread}
end

-- A replay: skip the entries Redis already has, checking each still stored one.
local published, duplicates, last_i = 0, 0, nil
for i = FIRST, #ARGV, PER do
  local id = ARGV[i]
  if id_less(top, id) then
    add(i)
    top = id
    last_i = i
    published = published + 1
  else
    local stored = redis.call('XRANGE', stream, id, id)
    if #stored == 1 then
      local fields = stored[1][2]
      for j = 1, #fields, 2 do
        if fields[j] == 'outbox_id' and fields[j + 1] ~= ARGV[i + 3] then
          return redis.error_reply('DIVERGED ' .. id .. ' holds outbox_id ' .. fields[j + 1] .. ', not ' .. ARGV[i + 3])
        end
      end
    elseif first and not id_less(id, first) then
      -- Not trimmed away (it is not below the oldest entry), yet not there: the top was
      -- moved past it by another writer, or entries were deleted.
      return redis.error_reply('DIVERGED ' .. id .. ' is below the stream top ' .. top .. ' but was never written there (another writer, or deleted entries)')
    end
    duplicates = duplicates + 1
  end
end
local unread = 0
if published > 0 then unread = trim() end
record(last_i)
if published == 0 then
  -- Nothing new was written, but a WAIT after this call must cover what an earlier call
  -- wrote here (maybe on a connection since lost): one small write moves this client's
  -- replication offset past it.
  redis.call('HINCRBY', origin_key, 'replays', 1)
end
return {published, duplicates, unread}
