package mmcache

import "context"

// MatchOrNone is Match for the scheduling path: it never fails the caller. On any
// failure (deadline, connection refused, an answer other than 200, bad JSON) it
// returns "no match": every distinct requested endpoint with score 0 and no
// matched items, as the service itself answers for endpoints it does not know,
// together with the error, for the caller's logs and metrics only. The signal is
// best effort: a gateway that cannot reach mmcache routes on its other scorers.
func (c *Client) MatchOrNone(ctx context.Context, req MatchRequest) (*MatchResponse, error) {
	resp, err := c.Match(ctx, req)
	if err == nil {
		return resp, nil
	}
	return NoMatch(req.Endpoints), err
}

// NoMatch is the answer that means "no endpoint holds anything": score 0 for each
// distinct endpoint, in order.
func NoMatch(endpoints []string) *MatchResponse {
	out := &MatchResponse{RequestItems: []Item{}, Endpoints: make([]EndpointMatch, 0, len(endpoints))}
	seen := make(map[string]bool, len(endpoints))
	for _, e := range endpoints {
		if seen[e] {
			continue
		}
		seen[e] = true
		out.Endpoints = append(out.Endpoints, EndpointMatch{Endpoint: e, MatchedItems: []Item{}})
	}
	return out
}

// Scores is what a gateway scorer needs: a score in [0, 1] for every candidate
// endpoint (0 for one without a match, and for all of them when mmcache is slow or
// down), plus the request's items, to record the placement after the pick without
// extracting them again. err is only for logs and metrics.
func (c *Client) Scores(ctx context.Context, endpoints []string, body any) (scores map[string]float64, items []Item, err error) {
	resp, err := c.MatchOrNone(ctx, MatchRequest{Endpoints: endpoints, Body: body})
	scores = make(map[string]float64, len(endpoints))
	for _, e := range endpoints {
		scores[e] = resp.Score(e)
	}
	return scores, resp.RequestItems, err
}
