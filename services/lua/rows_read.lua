-- A trainer's pull of rows of a shard group's embedding tables by ID, in the group's slot, as of one
-- group version (a script runs atomically: every row returned is as the group's version left it):
-- each row's version and values, the prefix of its stored record, never its optimizer state.
--
-- Called through services.scripts.RowsReadCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] version         the group's version
-- KEYS[2..] tables        the rows hash of each table asked, in order
-- ARGV[1] width           bytes of each record to return (a prefix of the stored one)
-- ARGV[2..] asks          per table, its IDs (8 little-endian bytes each, concatenated)
--
-- Returns {group version, then per table: mask, rows}: mask holds one byte per ID asked, 1 for a row
-- found, 0 for none; rows the returned prefixes of the rows found, concatenated in the order asked
-- (bulk bytes, never one reply per ID).
local K_VERSION = 1
local K_TABLES = 2
local A_WIDTH = 1
local A_ASKS = 2

local chunk = 4000  -- HMGET fields per call (Lua's unpack has a stack limit)
local width = tonumber(ARGV[A_WIDTH])
local out = {redis.call('GET', KEYS[K_VERSION]) or '0'}
for t = 0, #KEYS - K_TABLES do
  local hash, ids = KEYS[K_TABLES + t], ARGV[A_ASKS + t]
  local n = #ids / 8
  local mask, rows = {}, {}
  local i = 0
  while i < n do
    local j = math.min(i + chunk, n)
    local fields = {}
    for k = i, j - 1 do
      fields[#fields + 1] = string.sub(ids, 8 * k + 1, 8 * k + 8)
    end
    local got = redis.call('HMGET', hash, unpack(fields))
    for k = 1, #got do
      local v = got[k]
      if v then
        mask[i + k] = '\1'
        rows[#rows + 1] = string.sub(v, 1, width)
      else
        mask[i + k] = '\0'
      end
    end
    i = j
  end
  out[#out + 1] = table.concat(mask)
  out[#out + 1] = table.concat(rows)
end
return out
