// Package mmcache is a Go client of the mmcache HTTP API, for an inference gateway
// that replaces the in-process mm-embeddings-cache-producer plugin with the shared
// service. It uses the standard library only.
//
// A gateway makes four calls (docs/gateway.md in the repository says when and why):
//
//   - Produce (scheduling, on the hot path): Match with the candidate endpoints and
//     the request body, or MatchOrNone / Scores, which turn any failure into "no
//     match" because the signal is best effort;
//   - PreRequest (after the pick, off the hot path): Place with the chosen endpoint(s);
//   - endpoint deletion: DeleteEndpoint;
//   - the periodic pod-list sweep: SyncEndpoints.
//
// Every call takes a context; its deadline is the earlier of the context's and the
// client's default timeout for that call (MatchTimeout, WriteTimeout).
package mmcache

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Default timeouts. Match sits on the scheduling path of every request, so it gets
// tens of milliseconds; writes are off the hot path and may wait for the event log's
// acknowledgement (the service answers 503 after MMCACHE_PRODUCE_TIMEOUT_S, 2 s by
// default), so they get a little more than that.
const (
	DefaultMatchTimeout = 50 * time.Millisecond
	DefaultWriteTimeout = 3 * time.Second
)

// maxResponseBytes bounds how much of an answer is read.
const maxResponseBytes = 64 << 20

// Client calls one mmcache service. It is safe for concurrent use.
type Client struct {
	base         string
	http         *http.Client
	token        string
	matchToken   string
	matchTimeout time.Duration
	writeTimeout time.Duration
	userAgent    string
}

// Option configures a Client.
type Option func(*Client)

// WithHTTPClient sets the *http.Client (transport, TLS configuration, proxies,
// connection pool). The default is a client of its own with keep-alive connections;
// http.DefaultClient is not used.
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.http = hc } }

// WithToken sends "Authorization: Bearer <token>" on every call (the service's
// --auth-token-file protects writes and /v1/state; --match-auth-token-file, match).
func WithToken(token string) Option {
	return func(c *Client) { c.token, c.matchToken = token, token }
}

// WithMatchToken sends a different bearer token on /v1/match than on the other
// calls. Give it after WithToken; an empty token changes nothing, so it can come
// straight from an unset environment variable.
func WithMatchToken(token string) Option {
	return func(c *Client) {
		if token != "" {
			c.matchToken = token
		}
	}
}

// WithMatchTimeout sets the default timeout of Match (DefaultMatchTimeout); 0 leaves
// the deadline to the context alone.
func WithMatchTimeout(d time.Duration) Option { return func(c *Client) { c.matchTimeout = d } }

// WithWriteTimeout sets the default timeout of Place, DeleteEndpoint, SyncEndpoints
// and State (DefaultWriteTimeout); 0 leaves the deadline to the context alone.
func WithWriteTimeout(d time.Duration) Option { return func(c *Client) { c.writeTimeout = d } }

// WithUserAgent sets the User-Agent header.
func WithUserAgent(ua string) Option { return func(c *Client) { c.userAgent = ua } }

// New returns a client of the service at baseURL ("http://mmcache:8080", or https
// with WithHTTPClient for a private CA). A path in baseURL is kept as a prefix, for a
// service behind a reverse proxy.
func New(baseURL string, opts ...Option) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil {
		return nil, fmt.Errorf("mmcache: base URL %q: %w", baseURL, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("mmcache: base URL %q: want http://host:port or https://host:port", baseURL)
	}
	c := &Client{
		base:         strings.TrimRight(u.String(), "/"),
		http:         &http.Client{Transport: defaultTransport()},
		matchTimeout: DefaultMatchTimeout,
		writeTimeout: DefaultWriteTimeout,
		userAgent:    "mmcache-go",
	}
	for _, opt := range opts {
		opt(c)
	}
	if c.http == nil {
		return nil, errors.New("mmcache: WithHTTPClient(nil)")
	}
	return c, nil
}

// defaultTransport keeps enough idle connections to one host for a gateway's
// concurrency: with Go's default of 2, most matches under load would open a new
// connection and pay its handshake inside the 50 ms budget.
func defaultTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 64
	return t
}

// Match asks which of req.Endpoints probably hold req.Body's multimodal items.
// An error is *Error for an answer other than 200, else a transport, deadline or
// decoding error. Use MatchOrNone on the scheduling path.
func (c *Client) Match(ctx context.Context, req MatchRequest) (*MatchResponse, error) {
	req.Endpoints = nonNil(req.Endpoints)
	var out MatchResponse
	if err := c.do(ctx, c.matchTimeout, c.matchToken, http.MethodPost, "/v1/match", req, http.StatusOK, &out); err != nil {
		return nil, err
	}
	if out.RequestItems == nil || out.Endpoints == nil {
		return nil, errors.New("mmcache: match answer lacks request_items or endpoints")
	}
	return &out, nil
}

// Place records that a request was sent to req.Endpoints (the gateway's PreRequest).
// It returns once the events are durably in the event log; the effect shows in
// Match shortly after. A *Error with NotAcknowledged() means it may or may not have
// been recorded; sending it again is harmless.
func (c *Client) Place(ctx context.Context, req PlacementRequest) (*EventsAccepted, error) {
	return c.write(ctx, "/v1/placements", req)
}

// DeleteEndpoint drops the whole LRU of an endpoint that is gone.
func (c *Client) DeleteEndpoint(ctx context.Context, endpoint string) (*EventsAccepted, error) {
	return c.write(ctx, "/v1/endpoint-events", EndpointDeletedRequest{Type: "deleted", Endpoint: endpoint})
}

// SyncEndpoints drops every endpoint not in live (the periodic pod-list sweep).
// An empty live set changes nothing.
func (c *Client) SyncEndpoints(ctx context.Context, live []string) (*EventsAccepted, error) {
	return c.write(ctx, "/v1/endpoint-events", EndpointsSyncRequest{Type: "sync", Live: nonNil(live)})
}

// State returns per-endpoint counts (at most limit endpoints, most items first),
// the capacity and the state's digest. It uses the write token and timeout.
func (c *Client) State(ctx context.Context, limit int) (*StateResponse, error) {
	var out StateResponse
	path := "/v1/state?limit=" + strconv.Itoa(limit)
	if err := c.do(ctx, c.writeTimeout, c.token, http.MethodGet, path, nil, http.StatusOK, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

func (c *Client) write(ctx context.Context, path string, body any) (*EventsAccepted, error) {
	var out EventsAccepted
	if err := c.do(ctx, c.writeTimeout, c.token, http.MethodPost, path, body, http.StatusAccepted, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// do sends one request and decodes a `want` answer into out, any other into *Error.
// The body is always read to its end (bounded) and closed, so the connection is reused.
func (c *Client) do(ctx context.Context, timeout time.Duration, token, method, path string,
	in any, want int, out any) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	var body io.Reader
	if in != nil {
		raw, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("mmcache: encoding the %s body: %w", path, err)
		}
		body = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return fmt.Errorf("mmcache: %w", err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", c.userAgent)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("mmcache: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes))
	if err != nil {
		return fmt.Errorf("mmcache: %s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode != want {
		return decodeError(resp.StatusCode, raw)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return fmt.Errorf("mmcache: %s %s: decoding the answer: %w", method, path, err)
	}
	return nil
}

func decodeError(status int, raw []byte) *Error {
	var body errorBody
	if json.Unmarshal(raw, &body) == nil && body.Error != nil && body.Error.Code != "" {
		return &Error{Status: status, Code: body.Error.Code, Message: body.Error.Message}
	}
	text := strings.TrimSpace(string(raw))
	if len(text) > 200 {
		text = text[:200] + "..."
	}
	if text == "" {
		text = http.StatusText(status)
	}
	return &Error{Status: status, Message: text}
}
