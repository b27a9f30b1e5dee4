-- (After trim.lua, which the relay puts in front of this script: id_less, num_less,
-- trim_below, trim_acked.)
--
-- Publish one batch of outbox entries into a stream, atomically (a script runs alone and,
-- with appendfsync always, its writes are fsynced before the reply).
--
-- KEYS[1]  the stream
-- KEYS[2]  the stream's record (hash): which Postgres system and timeline write it
-- ARGV[1]  system_id of the Postgres cluster the entries come from
-- ARGV[2]  its timeline
-- ARGV[3]  --stream-max-len ('0': none): the most entries the stream may hold that some
--          consumer group has not acknowledged. A batch that would pass it is refused whole
--          (FULL) and nothing is ever trimmed unread: the shard falls behind, and the relay
--          publishes its rows from the outbox table once the groups have read
-- ARGV[4]  fence: the last id this relay session published before this batch ('' at the
--          start of a session); the stream's top must have reached it
-- ARGV[5]  the LSN (decimal) the relay will acknowledge to its slot once this call returns
--          ('': none). Recorded as `acked_through`, so Redis always knows at least as much
--          as the slot says was delivered to this shard
-- ARGV[6]  the shard count the relay writes with: the record must state the same (a stream
--          resized while this relay ran is refused with SHARDS; records from before shards
--          existed state nothing, which means 1)
-- ARGV[7]  the writer epoch of the relay session (see `writer_epoch` below); a session
--          older than the one the record names is refused with FENCED
-- ARGV[8]  a watermark the acknowledgement covers ('': none), recorded as `watermark`: a
--          snapshot such that the rows this shard may lack later are those it does not show
-- ARGV[9]  the first entry id a comparison with the outbox must read from for that
--          watermark ('' with none): recorded as `watermark_from`, or the stream's top before
--          this call when that is lower (a catch-up's entries carry ids just above the top),
--          and trimming never goes past it
-- ARGV[10] 'rejoin' when a catch-up ends with this call (its marker and progress go), or ''
-- ARGV[11] a catch-up's progress, recorded as `catch_up_cursor` ('': none): with this call,
--          every row its snapshot shows up to its outbox id is in the stream or consumed
-- ARGV[12] a snapshot every row of which is in the stream or consumed (a catch-up's round
--          finished), recorded as `catch_up_done` ('': none)
-- ARGV[13] L, the number of field names; ARGV[14..13+L] the names, the first three
--          `event`, `payload`, `outbox_id` (every entry has them), then the optional ones
--          (`created_at`, `traceparent`, `key`, the mapping's extra fields), sent once per
--          call rather than once per entry (a batch holds thousands)
-- ARGV[14+L..] runs of entries that have the same fields: the run's presence (one '1' or
--          '0' per name: whether its entries have that field), how many entries, then per
--          entry its id and the values of the fields it has, in the names' order; ids
--          strictly increase. Each new entry also gets `published_at` last: this call's
--          TIME in Unix microseconds, the start of the consumers' published-to-recorded
--          latency
--
-- Returns {published, duplicates, acked}: acked is the id below which every consumer group
-- acknowledged everything ('' when not read: no group, or nothing new was written). An entry whose id is not above the stream's
-- last-generated-id is a replay (Postgres re-sends what the slot did not acknowledge): it
-- is counted, not written, after checking that the entry stored under that id, if still
-- there, is the same outbox row.
-- Errors (codes read by the relay): FENCED (a newer relay session writes the stream), SHARDS
-- (the stream was resized), NORECORD (the record is gone: Redis lost data, or an operator
-- deleted it; only `setup` and the relay's recovery write a record), ORIGIN (another
-- cluster's stream), TIMELINE (the record names another timeline: the relay checks the
-- history before going on), GAP (the stream lost entries this session published), DIVERGED
-- (same id, different row, or an id below the top that the stream never held), FULL (the
-- stream holds --stream-max-len unread entries: nothing was written).

local stream, origin_key = KEYS[1], KEYS[2]
local system_id, timeline, maxlen, fence, ack, shards = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local epoch = tonumber(ARGV[7])
local watermark, watermark_from, rejoin = ARGV[8], ARGV[9], ARGV[10] == 'rejoin'
local cursor, done = ARGV[11], ARGV[12]
local L = tonumber(ARGV[13])
local names = {}
for j = 1, L do names[j] = ARGV[13 + j] end
local FIRST = 14 + L

-- Where each entry starts in ARGV (its id), in order, and the names its run has.
local starts, run_of, runs = {}, {}, {}
do
  local r = FIRST
  while r <= #ARGV do
    local presence, count = ARGV[r], tonumber(ARGV[r + 1])
    local present = {}
    for j = 1, L do
      if string.byte(presence, j) == 49 then present[#present + 1] = names[j] end
    end
    runs[#runs + 1] = present
    local i = r + 2
    for _ = 1, count do
      starts[#starts + 1] = i
      run_of[#run_of + 1] = #runs
      i = i + 1 + #present
    end
    r = i
  end
end

local origin = redis.call('HMGET', origin_key, 'system_id', 'timeline', 'acked_through', 'shards', 'writer_epoch', 'watermark_from')
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
elseif epoch > tonumber(origin[5] or '0') then
  -- This session's claim did not survive here (a failover to a replica that missed it):
  -- every call asserts it again.
  redis.call('HSET', origin_key, 'writer_epoch', ARGV[7])
end

local top, first, exists = '0-0', nil, redis.call('EXISTS', stream) == 1
if exists then
  local info = redis.call('XINFO', 'STREAM', stream)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      top = info[i + 1]
    elseif info[i] == 'first-entry' and info[i + 1] then
      first = info[i + 1][1]
    end
  end
end
local top_before = top

if fence ~= '' and id_less(top, fence) then
  return redis.error_reply('GAP top ' .. top .. ' is below ' .. fence)
end

-- Entries above the top are new (ids increase); the ones before them are replays.
local new_from = #starts + 1
for n, i in ipairs(starts) do
  if id_less(top, ARGV[i]) then
    new_from = n
    break
  end
end
local new = #starts + 1 - new_from

-- The replays first: each one still stored must be the same outbox row.
for n = 1, new_from - 1 do
  local i = starts[n]
  local id = ARGV[i]
  local stored = redis.call('XRANGE', stream, id, id)
  if #stored == 1 then
    local fields = stored[1][2]
    for j = 1, #fields, 2 do
      -- event, payload and outbox_id are every entry's first three values.
      if fields[j] == 'outbox_id' and fields[j + 1] ~= ARGV[i + 3] then
        return redis.error_reply('DIVERGED ' .. id .. ' holds outbox_id ' .. fields[j + 1] .. ', not ' .. ARGV[i + 3])
      end
    end
  elseif first and not id_less(id, first) then
    -- Not trimmed away (it is not below the oldest entry), yet not there: the top was
    -- moved past it by another writer, or entries were deleted.
    return redis.error_reply('DIVERGED ' .. id .. ' is below the stream top ' .. top .. ' but was never written there (another writer, or deleted entries)')
  end
end
local acked_below = ''
if new > 0 and exists then
  local _, acked = trim_acked(stream, origin[6])
  acked_below = acked or ''
  if maxlen > 0 then
    local unread = redis.call('XLEN', stream)
    if unread + new > maxlen and acked and origin[6] and id_less(origin[6], acked) then
      -- What the watermark's floor kept was read by every group: under the cap it yields
      -- (a catch-up from that watermark may then publish some of it again, never less).
      trim_below(stream, acked)
      unread = redis.call('XLEN', stream)
    end
    if unread + new > maxlen then
      return redis.error_reply('FULL ' .. unread .. ' entries unread, ' .. new .. ' more would pass ' .. maxlen)
    end
  end
end

-- The record beside the stream: the acknowledged LSN (only ever raised, and written on
-- every call that carries one, so that a WAIT after the call always has this call's write to
-- wait for), the last id the relay wrote, and the watermark.
local function record(last_i)
  if ack ~= '' then
    local acked = ack
    if origin[3] and num_less(ack, origin[3]) then acked = origin[3] end
    redis.call('HSET', origin_key, 'acked_through', acked)
  end
  if last_i then
    redis.call('HSET', origin_key, 'last_id', ARGV[last_i])
  end
  if watermark ~= '' then
    local from = watermark_from
    if top_before == '0-0' then
      from = '0-1'
    elseif id_less(top_before, from) then
      from = top_before
    end
    redis.call('HSET', origin_key, 'watermark', watermark, 'watermark_from', from)
  end
  if cursor ~= '' then
    redis.call('HSET', origin_key, 'catch_up_cursor', cursor)
  end
  if done ~= '' then
    redis.call('HSET', origin_key, 'catch_up_done', done)
  end
  if rejoin then
    redis.call('HDEL', origin_key, 'rebuilding', 'catch_up_cursor', 'catch_up_done')
  end
end

-- Redis's clock, read once per call: every entry of the batch was stored at that moment.
local clock = redis.call('TIME')
local published_at = clock[1] .. string.sub('000000' .. clock[2], -6)

-- One table reused for every entry's XADD (a batch holds thousands: no table each), its
-- names laid out once per run.
local args, args_run, args_len = {stream}, nil, 0
local function add(n)
  local i, run = starts[n], run_of[n]
  local present = runs[run]
  if run ~= args_run then
    local k = 2
    for _, name in ipairs(present) do
      args[k + 1] = name
      k = k + 2
    end
    args[k + 1], args[k + 2] = 'published_at', published_at
    args_run, args_len = run, k + 2
  end
  args[2] = ARGV[i]
  for j = 1, #present do
    args[2 + 2 * j] = ARGV[i + j]
  end
  redis.call('XADD', unpack(args, 1, args_len))
end

for n = new_from, #starts do
  add(n)
end
local last_i = nil
if new > 0 then last_i = starts[#starts] end
record(last_i)
if new == 0 and ack == '' and watermark == '' and cursor == '' and done == '' then
  -- Nothing was written, but a WAIT after this call must cover what an earlier call wrote
  -- here (maybe on a connection since lost): one small write moves this client's
  -- replication offset past it.
  redis.call('HINCRBY', origin_key, 'replays', 1)
end
return {new, new_from - 1, acked_below}
