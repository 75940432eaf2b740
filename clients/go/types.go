package mmcache

import (
	"encoding/json"
	"fmt"
)

// Item is one unique multimodal input of a request (schemas/*: Item).
//
// Size is the item's weight in the LRU: its length in embeddings or tokens when
// the producer knows it (the token producer's mm_features length), else 1.
type Item struct {
	Hash     string `json:"hash"`
	Size     int64  `json:"size"`
	Modality string `json:"modality"`
}

// MatchRequest is the body of POST /v1/match (schemas/match-request.schema.json).
//
// Body is the inference request as one JSON object: {"chat_completions": {...}},
// {"responses": {...}}, {"generate": {...}}, {"tokenized": {...}}, or a plain OpenAI
// body: chat completions (a top-level "messages" list) or Responses (a top-level
// "input" list). Any value encoding/json marshals to an object will do: a map, a
// struct, or a json.RawMessage of the bytes the gateway holds (see ChatCompletions
// and Responses).
type MatchRequest struct {
	Endpoints []string `json:"endpoints"`
	Body      any      `json:"body"`
	RequestID string   `json:"request_id,omitempty"`
}

// MatchResponse is the answer of POST /v1/match (schemas/match-response.schema.json).
//
// Endpoints has one entry per distinct requested endpoint, in request order, or
// none at all when the body holds no multimodal item.
type MatchResponse struct {
	RequestItems []Item          `json:"request_items"`
	Endpoints    []EndpointMatch `json:"endpoints"`
}

// EndpointMatch is the match data of one endpoint (the plugin's EncoderCacheMatchInfo).
//
// MatchedWeight is the sum of the sizes of MatchedItems, TotalWeight the sum of the
// sizes of all the request's items, and Score = MatchedWeight / TotalWeight in [0, 1].
//
// Source says what the endpoint was matched against: "engine" (the cache its model
// server reported through /v1/engine-events) or "estimate" (its LRU of placements).
// It is "" from a service that does not say, and in NoMatch's answers.
type EndpointMatch struct {
	Endpoint      string  `json:"endpoint"`
	MatchedItems  []Item  `json:"matched_items"`
	MatchedWeight int64   `json:"matched_weight"`
	TotalWeight   int64   `json:"total_weight"`
	Score         float64 `json:"score"`
	Source        string  `json:"source,omitempty"`
}

// Score is the score of endpoint, 0 when the answer does not name it (an unknown
// endpoint, or a request without multimodal items).
func (r *MatchResponse) Score(endpoint string) float64 {
	for i := range r.Endpoints {
		if r.Endpoints[i].Endpoint == endpoint {
			return r.Endpoints[i].Score
		}
	}
	return 0
}

// Scores maps every endpoint of the answer to its score.
func (r *MatchResponse) Scores() map[string]float64 {
	scores := make(map[string]float64, len(r.Endpoints))
	for _, m := range r.Endpoints {
		scores[m.Endpoint] = m.Score
	}
	return scores
}

// PlacementRequest is the body of POST /v1/placements
// (schemas/placement-request.schema.json): the request was sent to Endpoints.
//
// Give exactly one of Items (the request's items, as a match answered them in
// RequestItems) or Body (the service extracts the items itself, as for a match).
// A non-nil empty Items is sent as "items": [] and records nothing.
type PlacementRequest struct {
	RequestID string
	Endpoints []string
	Items     []Item
	Body      any
}

// MarshalJSON writes "items" when Items is non-nil and "body" when Body is, so that
// an empty item list stays distinguishable from no list at all.
func (p PlacementRequest) MarshalJSON() ([]byte, error) {
	out := struct {
		RequestID string   `json:"request_id,omitempty"`
		Endpoints []string `json:"endpoints"`
		Items     *[]Item  `json:"items,omitempty"`
		Body      any      `json:"body,omitempty"`
	}{RequestID: p.RequestID, Endpoints: nonNil(p.Endpoints), Body: p.Body}
	if p.Items != nil {
		out.Items = &p.Items
	}
	return json.Marshal(out)
}

// EndpointDeletedRequest is the body of POST /v1/endpoint-events for a pod that is
// gone (schemas/endpoint-event-request.schema.json): its whole LRU is dropped.
type EndpointDeletedRequest struct {
	Type     string `json:"type"` // always "deleted"
	Endpoint string `json:"endpoint"`
}

// EndpointsSyncRequest is the body of POST /v1/endpoint-events for the periodic
// pod-list sweep: every endpoint not in Live is dropped. An empty Live is ignored
// by the service (it answers {"events": 0}), so an empty pod list never wipes the state.
type EndpointsSyncRequest struct {
	Type string   `json:"type"` // always "sync"
	Live []string `json:"live"`
}

// EventsAccepted is the 202 answer of every write (schemas/events-accepted.schema.json):
// how many events the event log acknowledged (a placement to k distinct endpoints is
// k events; a sync is one; a placement without items is none).
type EventsAccepted struct {
	Events int `json:"events"`
}

// StateResponse is the answer of GET /v1/state (schemas/state-response.schema.json).
type StateResponse struct {
	Endpoints      []EndpointState `json:"endpoints"`
	TotalEndpoints int             `json:"total_endpoints"`
	Capacity       Capacity        `json:"capacity"`
	Digest         string          `json:"digest"`
}

// EndpointState counts the entries of one endpoint; hashes are never exposed.
type EndpointState struct {
	Endpoint string `json:"endpoint"`
	Items    int64  `json:"items"`
	Weight   int64  `json:"weight"`
}

// Capacity is the per-endpoint LRU capacity: Mode "items" (entries) or "size" (sum of sizes).
type Capacity struct {
	Mode        string `json:"mode"`
	PerEndpoint int64  `json:"per_endpoint"`
}

// Error is an answer other than 2xx (schemas/error.schema.json), with its HTTP status.
//
// Codes the service uses: invalid_json and invalid_request (400, Message names the
// field or the limit), unauthorized (401), body_too_large (413),
// log_unavailable and overloaded (503). An answer whose body is not the JSON
// error shape (a proxy's page) has an empty Code and the start of the body as Message.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string {
	if e.Code == "" {
		return fmt.Sprintf("mmcache: HTTP %d: %s", e.Status, e.Message)
	}
	return fmt.Sprintf("mmcache: HTTP %d %s: %s", e.Status, e.Code, e.Message)
}

// NotAcknowledged reports a 503 on a write: the event log did not acknowledge it in
// time. It may still have been written; every write is safe to send again.
func (e *Error) NotAcknowledged() bool { return e.Status == 503 }

type errorBody struct {
	Error *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// ChatCompletions wraps the raw bytes of an OpenAI chat-completions request body as
// a match or placement body: {"chat_completions": <raw>}.
func ChatCompletions(raw []byte) json.RawMessage { return wrap("chat_completions", raw) }

// Responses wraps the raw bytes of an OpenAI Responses request body ({"input": [...]})
// as a match or placement body: {"responses": <raw>}.
func Responses(raw []byte) json.RawMessage { return wrap("responses", raw) }

// Generate wraps the raw bytes of a vLLM generate request ({"features": {"mm_hashes": ...}}).
func Generate(raw []byte) json.RawMessage { return wrap("generate", raw) }

// Tokenized wraps the raw bytes of the token producer's output ({"prompts": [...]}).
func Tokenized(raw []byte) json.RawMessage { return wrap("tokenized", raw) }

func wrap(key string, raw []byte) json.RawMessage {
	out := make([]byte, 0, len(raw)+len(key)+5)
	out = append(out, `{"`...)
	out = append(out, key...)
	out = append(out, `":`...)
	out = append(out, raw...)
	out = append(out, '}')
	return out
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
