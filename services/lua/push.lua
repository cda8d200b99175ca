-- Append one update to the log and commit its Kafka offsets, fenced, in one atomic step (the job's
-- slot). The update's gradient blobs were written before, into each group's slot; a refused push
-- leaves them to the pusher to delete (and to the groups' sweepers, should the pusher die first).
--
-- Called through services.scripts.PushCall, which renders KEYS and ARGV by the names below;
-- tests/test_services_protocol.py checks that these lines, the K_/A_ locals and the class agree.
-- KEYS[1] generation    the membership generation
-- KEYS[2] assignment    partition -> the fence token of its owner
-- KEYS[3] offsets       partition -> next offset to consume
-- KEYS[4] update_log
-- KEYS[5] clocks        member -> clock of its last push
-- KEYS[6] unapplied     updates not yet applied by every group
-- ARGV[1] member_id
-- ARGV[2] generation    the generation the member holds
-- ARGV[3] fence         the member's fence token at that generation
-- ARGV[4] clock
-- ARGV[5] max_pending   most unapplied updates before a push is refused
-- ARGV[6] range_count   number n of offset ranges
-- ARGV[7..] ranges      partition, first, next of each range (3n values), then the field/value
--                       pairs of the log entry
-- Returns the new log entry id, or an error reply starting with FENCED, OFFSET, CLOCK or BACKPRESSURE.
local K_GENERATION = 1
local K_ASSIGNMENT = 2
local K_OFFSETS = 3
local K_UPDATE_LOG = 4
local K_CLOCKS = 5
local K_UNAPPLIED = 6
local A_MEMBER_ID = 1
local A_GENERATION = 2
local A_FENCE = 3
local A_CLOCK = 4
local A_MAX_PENDING = 5
local A_RANGE_COUNT = 6
local A_RANGES = 7

local member, gen, owner = ARGV[A_MEMBER_ID], ARGV[A_GENERATION], ARGV[A_FENCE]
local clock = tonumber(ARGV[A_CLOCK])
local n = tonumber(ARGV[A_RANGE_COUNT])
local function range(i)  -- partition, first, next of range i (0-based)
  local at = A_RANGES + 3 * i
  return ARGV[at], ARGV[at + 1], ARGV[at + 2]
end
local function refuse(message)
  return redis.error_reply(message)
end

local current = redis.call('GET', KEYS[K_GENERATION])
if current ~= gen then
  return refuse('FENCED generation ' .. gen .. ' of member ' .. member ..
    ' is stale: current generation is ' .. tostring(current or 'unset'))
end
for i = 0, n - 1 do
  local p = range(i)
  local holder = redis.call('HGET', KEYS[K_ASSIGNMENT], p)
  if holder ~= owner then
    return refuse('FENCED partition ' .. p .. ' is assigned to ' .. tostring(holder or 'nobody') ..
      ', not ' .. owner)
  end
end
for i = 0, n - 1 do
  local p, first = range(i)
  local committed = redis.call('HGET', KEYS[K_OFFSETS], p)
  if committed and committed ~= first then
    return refuse('OFFSET partition ' .. p .. ': range starts at ' .. first ..
      ' but the committed offset is ' .. committed .. (tonumber(first) < tonumber(committed)
      and ' (a duplicate)' or ' (a gap)'))
  end
end
local last = tonumber(redis.call('HGET', KEYS[K_CLOCKS], member) or '0')
if clock <= last then
  return refuse('CLOCK member ' .. member .. ' pushed clock ' .. ARGV[A_CLOCK] ..
    ' but its last pushed clock is ' .. last .. ' (a duplicate or out-of-order push)')
end
if tonumber(redis.call('GET', KEYS[K_UNAPPLIED]) or '0') >= tonumber(ARGV[A_MAX_PENDING]) then
  return refuse('BACKPRESSURE update log holds ' .. ARGV[A_MAX_PENDING] ..
    ' unapplied updates; parameter servers are behind')
end
local fields = {}
for i = A_RANGES + 3 * n, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local id = redis.call('XADD', KEYS[K_UPDATE_LOG], '*', unpack(fields))
for i = 0, n - 1 do
  local p, _, nxt = range(i)
  redis.call('HSET', KEYS[K_OFFSETS], p, nxt)
end
redis.call('HSET', KEYS[K_CLOCKS], member, ARGV[A_CLOCK])
redis.call('INCR', KEYS[K_UNAPPLIED])
return id
